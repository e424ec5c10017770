"""The one exception type a user can cause: its message names the file or value and the fix."""


class Qwen35Error(ValueError):
    """Bad input (a path, a checkpoint, a prompt, a setting) with a message meant for the user."""
