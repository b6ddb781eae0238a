"""Device memory: the integer allocator, the arena that owns the one device buffer,
and the eviction policies that pick which resident model makes room."""

from timeshare.memory.allocator import Allocator, Block
from timeshare.memory.arena import Arena
from timeshare.memory.eviction import EvictionPolicy, LRUPolicy, make_eviction_policy

__all__ = ["Allocator", "Arena", "Block", "EvictionPolicy", "LRUPolicy", "make_eviction_policy"]
