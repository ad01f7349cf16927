"""Where chunks live: the host arena (``host``), and byte tiers behind the ``Tier`` protocol."""

from kvdepot.storage.base import Tier, TierStats
from kvdepot.storage.host import HostTier
from kvdepot.storage.policy import POLICIES, LRUPolicy

__all__ = ["POLICIES", "HostTier", "LRUPolicy", "Tier", "TierStats"]
