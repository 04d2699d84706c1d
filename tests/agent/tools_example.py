"""Tools the agent tests load by dotted path, as users load their own."""
import time


def echo(arguments: str) -> str:
    return arguments


def slow(arguments: str) -> str:
    """Answers after the number of seconds it is given (a tool that hangs, for the timeout)."""
    time.sleep(float(arguments or 0))
    return "late"


def broken(arguments: str) -> str:
    raise RuntimeError(f"cannot handle {arguments!r}")


def not_text(arguments: str):
    return 42


NOT_A_FUNCTION = 3
