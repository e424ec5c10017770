"""The one exception type a user can cause: its message names the file or value and the fix; and the number tests
the checks of user values share."""
import numbers
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


def real_number(value) -> float | None:
    """`value` as a float when it is a real number (Python's, numpy's, a 0-d tensor; not a bool), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array: its Python number
        return real_number(value.item())
    return None
