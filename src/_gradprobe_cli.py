"""The ``gradprobe`` command's entry point. It lives outside the package so that a failure while
importing gradprobe or torch (``TORCH_LOGS=bogus`` fails torch's own import) still ends the way any
crash of the command does: exit status 3, one line, the traceback only with ``-v``."""

from __future__ import annotations

import sys

EXIT_INTERNAL = 3


def main() -> int:
    try:
        from gradprobe.cli import main as run
    except Exception as e:
        return crashed(e, verbose=bool({"-v", "--verbose"} & set(sys.argv[1:])))
    return run()


def crashed(e: BaseException, verbose: bool) -> int:
    """The one line a crash prints, and its exit status (3)."""
    import traceback

    if verbose:
        traceback.print_exception(e)
    text = str(e).strip().splitlines()
    sys.stderr.write(
        f"gradprobe: internal error: {type(e).__name__}: {text[0] if text else ''}\n"
        "  gradprobe itself (or torch underneath it) failed, not your model: "
        + (
            "please report it with the traceback above\n"
            if verbose
            else "run again with -v for the traceback, and please report it\n"
        )
    )
    return EXIT_INTERNAL
