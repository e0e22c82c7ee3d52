"""lp-megatron: a later issue fills this in."""
