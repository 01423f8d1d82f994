"""Put Horovod 0.28.1's own Ray test files where tests/frameworks/test_horovod_suites.py reads them.

They are not in this repository (they are Horovod's) nor in Horovod's sdist on PyPI (which holds the library
only), so they come from a Horovod source tree you have: a checkout of the v0.28.1 tag, or its source archive
(.tar.gz or .zip), given with ``--from``. They go to ``~/.cache/hora/horovod-0.28.1/test`` (``HORA_HOROVOD_TESTS``
or ``--to`` elsewhere).

    python scripts/fetch_horovod_tests.py --from ~/src/horovod            # a checkout at v0.28.1
    python scripts/fetch_horovod_tests.py --from horovod-0.28.1.tar.gz    # the tag's source archive
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.frameworks.horovod_suites import FILES  # noqa: E402
from tests.horovod_sdist import cache_dir  # noqa: E402


def _from_archive(archive: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                for f in FILES:
                    if name.endswith("test/" + f):
                        found[f] = z.read(name)
    else:
        with tarfile.open(archive) as t:
            for member in t.getmembers():
                for f in FILES:
                    if member.isfile() and member.name.endswith("test/" + f):
                        data = t.extractfile(member)
                        if data is not None:
                            found[f] = data.read()
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="a Horovod 0.28.1 checkout, or its source archive (.tar.gz, .zip)")
    p.add_argument("--to", type=Path, default=Path(os.environ.get("HORA_HOROVOD_TESTS") or cache_dir() / "test"))
    ns = p.parse_args()
    if ns.source.is_dir():
        found = {f: (ns.source / "test" / f).read_bytes() for f in FILES if (ns.source / "test" / f).is_file()}
    else:
        found = _from_archive(ns.source)
    missing = [f for f in FILES if f not in found]
    if missing:
        print(f"fetch_horovod_tests: {ns.source} has no test/{', test/'.join(missing)}; give Horovod 0.28.1's "
              "source tree or archive", file=sys.stderr)
        return 1
    for name, data in found.items():
        target = ns.to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        print(f"{target} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
