"""What the official-client checks share: their imports, their arguments and their report.

Each check script runs as `python3 tests/serve/NAME.py ...`, so this module is found
beside it.
"""

import importlib
import sys


def imports(*names):
    """The named modules; exits 2 with the pip command that installs them if one is missing."""
    try:
        return [importlib.import_module(name) for name in names]
    except ImportError as e:
        print(f"FAIL: import: {e} (python3 -m pip install {' '.join(names)})", file=sys.stderr)
        sys.exit(2)


def arguments(doc, count):
    """The script's `count` arguments; exits 2 with its usage `doc` if they are not that many."""
    if len(sys.argv) != count + 1:
        print(doc, file=sys.stderr)
        sys.exit(2)
    return sys.argv[1:]


def run(checks, *args):
    """Runs each `check(*args)`, printing `ok: NAME: what it returned` or `FAIL: NAME: why`,
    and exits 1 if any failed (0 if none did)."""
    failed = 0
    for check in checks:
        try:
            print(f"ok: {check.__name__}: {check(*args)}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failed += 1
            print(f"FAIL: {check.__name__}: {type(e).__name__}: {e}", flush=True)
    sys.exit(1 if failed else 0)
