"""Offline tools that use kvserve but are no part of serving (they may import the engine)."""
