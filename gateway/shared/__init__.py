"""Routing state shared between gateway instances through Redis (optional, `[redis]`)."""
