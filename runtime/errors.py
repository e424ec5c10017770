"""The one exception type a user can cause: its message names the file or value and the fix; and the whole-number
test the checks of user values share."""
import operator


class Qwen35Error(ValueError):
    """Bad input (a path, a checkpoint, a prompt, a setting) with a message meant for the user."""


def whole_number(value) -> int | None:
    """`value` as an int when it is a whole number of an integer type (Python's, numpy's, a 0-d tensor; not a
    bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
