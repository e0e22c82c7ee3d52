"""Check the wheels and sdists that `nox -s wheels` built, before anything is published.

    python .ci/check_dists.py DIST_DIR

For every workspace member (each ``packages/*/pyproject.toml``) DIST_DIR must hold one
wheel and one sdist, and both must carry:

- the repository's LICENSE and NOTICE, byte for byte (``License-File`` entries in the
  metadata and the files themselves: ``*.dist-info/licenses/`` in the wheel, the sdist's
  top directory);
- ``py.typed`` next to every top-level import package;
- the version of ``__version__`` in ``src/<package>/__init__.py`` (the one version
  source) and the same version as every other member (lp's packages are released
  together);
- ``Requires-Python``, ``License-Expression: Apache-2.0`` (and no deprecated
  ``License ::`` classifier), ``Author``, ``Keywords``, valid trove classifiers that
  include one per supported Python version, an OS, "Topic :: Scientific/Engineering ::
  Artificial Intelligence" and "Typing :: Typed";
- an exact pin (``==`` the workspace version) on every other member it depends on.

Exits non-zero listing every problem found. Uses ``packaging`` and ``trove-classifiers``
(the dev dependency group).
"""

from __future__ import annotations

import email.parser
import email.policy
import re
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from trove_classifiers import classifiers as KNOWN_CLASSIFIERS

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
REQUIRED_CLASSIFIERS = (
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Typing :: Typed",
)
LICENSE_FILES = ("LICENSE", "NOTICE")
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)


@dataclass
class Member:
    """A workspace member: its project name, directory and source version."""

    name: str
    path: Path
    version: str


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)

    def check(self, ok: bool, where: str, what: str) -> None:
        if not ok:
            self.problems.append(f"{where}: {what}")


def members() -> list[Member]:
    """Every ``packages/*`` member, its version read from ``src/*/__init__.py``."""
    found = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        text = pyproject.read_text()
        name = re.search(r'^name = "([^"]+)"$', text, re.MULTILINE)
        if name is None:
            raise SystemExit(f'{pyproject}: no `name = "..."` line in [project]')
        versions = [
            m.group(1)
            for init in sorted(pyproject.parent.glob("src/*/__init__.py"))
            if (m := VERSION_LINE.search(init.read_text()))
        ]
        if len(versions) != 1:
            raise SystemExit(
                f'{pyproject.parent}: expected one `__version__ = "..."` in src/*/__init__.py, '
                f"found {len(versions)}"
            )
        found.append(Member(name.group(1), pyproject.parent, versions[0]))
    return found


def parse_metadata(text: str) -> Message:
    return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


def check_metadata(
    report: Report, where: str, meta: Message, member: Member, names: set[str], version: str
) -> None:
    report.check(
        canonicalize_name(meta.get("Name", "")) == canonicalize_name(member.name),
        where,
        f"Name is {meta.get('Name')!r}, expected {member.name!r}",
    )
    report.check(
        meta.get("Version") == member.version,
        where,
        f"Version {meta.get('Version')!r} is not __version__ {member.version!r}",
    )
    report.check(
        member.version == version,
        where,
        f"version {member.version} differs from the workspace version {version}",
    )
    report.check(
        meta.get("License-Expression") == "Apache-2.0",
        where,
        f"License-Expression is {meta.get('License-Expression')!r}, expected 'Apache-2.0' "
        '(pyproject: license = "Apache-2.0")',
    )
    report.check(
        sorted(meta.get_all("License-File") or []) == sorted(LICENSE_FILES),
        where,
        f"License-File entries {meta.get_all('License-File')} are not {list(LICENSE_FILES)} "
        '(pyproject: license-files = ["LICENSE", "NOTICE"])',
    )
    report.check(bool(meta.get("Author") or meta.get("Author-email")), where, "no Author")
    for key in ("Keywords", "Requires-Python"):
        report.check(bool(meta.get(key)), where, f"no {key}")
    requires_python = SpecifierSet(meta.get("Requires-Python") or ">=0")
    classifiers = set(meta.get_all("Classifier") or [])
    for c in sorted(classifiers - KNOWN_CLASSIFIERS):
        report.check(False, where, f"unknown trove classifier {c!r}")
    for c in sorted(c for c in classifiers if c.startswith("License ::")):
        report.check(False, where, f"license classifier {c!r} (deprecated by PEP 639)")
    for c in REQUIRED_CLASSIFIERS:
        report.check(c in classifiers, where, f"classifier {c!r} missing")
    report.check(
        any(c.startswith("Operating System ::") for c in classifiers),
        where,
        "no 'Operating System ::' classifier",
    )
    for py in PYTHONS:
        declared = f"Programming Language :: Python :: {py}" in classifiers
        allowed = requires_python.contains(Version(f"{py}.0"))
        report.check(
            declared == allowed,
            where,
            f"Python {py}: Requires-Python {requires_python} "
            f"{'allows' if allowed else 'excludes'} it but the classifier is "
            f"{'present' if declared else 'missing'}",
        )
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if canonicalize_name(req.name) in names:
            report.check(
                str(req.specifier) == f"=={version}",
                where,
                f"depends on {req.name}{req.specifier}: workspace members pin each other "
                f"exactly ({req.name}=={version})",
            )


def check_files(report: Report, where: str, files: dict[str, bytes], prefix: str) -> None:
    """LICENSE/NOTICE identical to the repository's, under ``prefix``."""
    for name in LICENSE_FILES:
        content = files.get(prefix + name)
        report.check(content is not None, where, f"{prefix}{name} missing")
        report.check(
            content is None or content == (ROOT / name).read_bytes(),
            where,
            f"{prefix}{name} differs from the repository's {name}",
        )


def top_level_packages(paths: list[str]) -> set[str]:
    return {p.split("/")[0] for p in paths if p.count("/") == 1 and p.endswith("/__init__.py")}


def check_wheel(report: Report, wheel: Path, member: Member, names: set[str], version: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        files = {n: zf.read(n) for n in zf.namelist() if not n.endswith("/")}
    dist_info = f"{canonicalize_name(member.name).replace('-', '_')}-{member.version}.dist-info/"
    where = wheel.name
    meta = files.get(dist_info + "METADATA")
    report.check(meta is not None, where, f"{dist_info}METADATA missing")
    if meta is not None:
        check_metadata(report, where, parse_metadata(meta.decode()), member, names, version)
    check_files(report, where, files, dist_info + "licenses/")
    packages = top_level_packages(list(files))
    report.check(bool(packages), where, "no import package")
    for pkg in sorted(packages):
        report.check(f"{pkg}/py.typed" in files, where, f"{pkg}/py.typed missing")


def check_sdist(report: Report, sdist: Path, member: Member, names: set[str], version: str) -> None:
    with tarfile.open(sdist) as tf:
        members_ = tf.getmembers()
        links = [m.name for m in members_ if m.issym() or m.islnk()]
        files = {
            m.name: tf.extractfile(m).read()  # type: ignore[union-attr]
            for m in members_
            if m.isfile()
        }
    top = f"{canonicalize_name(member.name).replace('-', '_')}-{member.version}/"
    where = sdist.name
    report.check(not links, where, f"links in the sdist (installers refuse them): {links}")
    meta = files.get(top + "PKG-INFO")
    report.check(meta is not None, where, f"{top}PKG-INFO missing")
    if meta is not None:
        check_metadata(report, where, parse_metadata(meta.decode()), member, names, version)
    check_files(report, where, files, top)
    src = [n[len(top) + len("src/") :] for n in files if n.startswith(top + "src/")]
    packages = top_level_packages(src)
    report.check(bool(packages), where, "no import package under src/")
    for pkg in sorted(packages):
        report.check(f"{pkg}/py.typed" in src, where, f"src/{pkg}/py.typed missing")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dist = Path(argv[0])
    workspace = members()
    names = {canonicalize_name(m.name) for m in workspace}
    version = workspace[0].version  # every member must have it: checked per member below
    report = Report()
    for member in workspace:
        stem = canonicalize_name(member.name).replace("-", "_")
        for kind, pattern, check in (
            ("wheel", f"{stem}-*.whl", check_wheel),
            ("sdist", f"{stem}-*.tar.gz", check_sdist),
        ):
            built = sorted(dist.glob(pattern))
            report.check(
                len(built) == 1, member.name, f"expected one {kind} in {dist}, found {built}"
            )
            for path in built:
                check(report, path, member, names, version)
        # The package directory's copies must be the repository's (they go into the sdist).
        for name in LICENSE_FILES:
            copy = member.path / name
            report.check(
                copy.is_file() and not copy.is_symlink(),
                member.name,
                f"{copy.relative_to(ROOT)} must be a regular file (a copy of /{name})",
            )
    checked = ", ".join(f"{m.name} {m.version}" for m in workspace)
    if report.problems:
        print(f"{len(report.problems)} problem(s) in {dist}:", file=sys.stderr)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"ok: wheel and sdist of {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
