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


def flag(name: str, value, meaning: str = "True or False") -> bool:
    """`value` as a bool when it is one (Python's, numpy's, a 0-d bool tensor) or the whole number 0 or 1 (as a
    JSON API sends them); else a Qwen35Error naming it: text such as "false" is true to Python, and would turn the
    setting on."""
    if isinstance(value, bool):
        return value
    if getattr(value, "ndim", None) == 0 and str(getattr(value, "dtype", "")).endswith("bool"):
        return bool(value)
    whole = whole_number(value)
    if whole in (0, 1):
        return bool(whole)
    raise Qwen35Error(f"{name} is {value!r} ({type(value).__name__}); it must be {meaning}")


def real_number(value) -> float | None:
    """`value` as a float when it is a real number (Python's, numpy's, a 0-d tensor; not a bool), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array: its Python number
        return real_number(value.item())
    return None
