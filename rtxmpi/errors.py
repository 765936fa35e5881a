"""The typed errors every layer raises (docs/design.md, "Invariants").

RtxmpiError
 +-- ConfigError            bad configuration or input a user can fix (also a ValueError)
 |    +-- DirectoryLocked    another job holds the checkpoint directory's lock
 |    +-- ProfileError       a cluster hardware profile file is malformed; names the field
 +-- CollectiveError        a collective could not complete correctly
 |    +-- CollectiveTimeout  a wait passed its deadline; names op, sequence number, missing ranks
 |    +-- CollectiveMismatch ranks called a collective with different op/shape/dtype
 +-- RankFailure            a peer process died (ULFM) or stopped making progress
 +-- CheckpointError        a checkpoint is missing, uncommitted, truncated or corrupt

The recovery layer decides what to do from the class alone: RankFailure may be survived by
shrinking; CollectiveTimeout and CollectiveMismatch tear the job down.
"""


class RtxmpiError(Exception):
    """Base class of every error rtxmpi raises on purpose."""


class ConfigError(RtxmpiError, ValueError):
    """A configuration or argument a user can fix; the message says how."""


class DirectoryLocked(ConfigError):
    """Another job holds the lock of a checkpoint directory. Attribute: holder (the record read
    from the lock file: job_id, host, pid, start_unix, attempt; untrusted, may be None)."""

    def __init__(self, message, *, holder=None):
        super().__init__(message)
        self.holder = holder


class ProfileError(ConfigError):
    """A cluster hardware profile (rtxmpi.parallel.cluster_profile) is malformed. Attributes:
    field (the dotted path of the bad field, e.g. "device.hbm_gbps"), path (the file or None)."""

    def __init__(self, message, *, field="", path=None):
        super().__init__(message)
        self.field, self.path = field, path


class CollectiveError(RtxmpiError):
    """A collective operation could not complete correctly."""


class CollectiveTimeout(CollectiveError):
    """A blocking wait passed its deadline.

    Attributes: op (str), seq (int, the group's sequence number of the call), group (str),
    missing (list of world ranks that did not arrive), timeout_s (float).
    """

    def __init__(self, message, *, op="", seq=-1, group="world", missing=(), timeout_s=0.0):
        super().__init__(message)
        self.op, self.seq, self.group = op, seq, group
        self.missing, self.timeout_s = list(missing), timeout_s


class CollectiveMismatch(CollectiveError):
    """Ranks called the same collective slot with different op, shape or dtype (checking mode)."""


class RankFailure(RtxmpiError):
    """A peer rank died or stopped making progress. Attribute: ranks (list of world ranks)."""

    def __init__(self, message, *, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


class SpawnFailed(RtxmpiError):
    """MPI_Comm_spawn could not start processes (no free slot, the program not found)."""


class CheckpointError(RtxmpiError):
    """A checkpoint cannot be written or loaded safely; the message names the file and dataset."""
