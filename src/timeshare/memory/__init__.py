"""Device memory: the integer allocator and the arena that owns the one device buffer.
(Which resident model makes room is the scheduler's: ``timeshare.scheduler.eviction``.)"""

from timeshare.memory.allocator import Allocator, Block
from timeshare.memory.arena import Arena

__all__ = ["Allocator", "Arena", "Block"]
