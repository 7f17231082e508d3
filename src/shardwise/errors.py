"""The one exception type shardwise raises for a user's mistake.

Every message names the problem and the fix; catching `ShardwiseError` separates
"you asked for something that cannot work" from a bug inside torch or shardwise.
"""


class ShardwiseError(RuntimeError):
    """A configuration, model or checkpoint problem the user can fix; the message says how."""
