"""The one exception type shardwise raises for a user's mistake.

Every message names the problem and the fix; catching `ShardwiseError` separates
"you asked for something that cannot work" from a bug inside torch or shardwise.
"""


class ShardwiseError(RuntimeError):
    """A configuration, model or checkpoint problem the user can fix; the message says how."""


class ShardwiseWarning(UserWarning):
    """Something that works but is likely not what the user wants (e.g. a unit plan that keeps
    most parameters in the root); the message says what to change."""
