class UserError(Exception):
    """A mistake the user can fix (bad path, wrong checkpoint, bad option).

    `run_main` prints it as one line, without a traceback, and exits with code 2.
    The message should name the fix.
    """
