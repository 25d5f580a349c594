class UserError(Exception):
    """A mistake the user can fix (bad path, wrong checkpoint, bad option).

    `run_main` prints it as one line, without a traceback, and exits with code 2: from the main process only (every
    process of a job usually meets the same mistake), or from every process that meets it (`every_process`, for a
    mistake no main process may exist to report, such as inconsistent launcher variables).
    The message should name the fix.
    """

    def __init__(self, message: str, *, every_process: bool = False):
        super().__init__(message)
        self.every_process = every_process
