"""The one error type the command line maps to ``xmc-spark: error: ...`` and exit code 2.

Every problem a user can fix (bad input, bad config, a stage run out of order, a broken model
folder, a Spark session that cannot start) raises a subclass of :class:`XmcError` with a
message naming the file, line, table, column or key at fault; anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations


class XmcError(Exception):
    """A problem the user can fix; the message says what and where."""
