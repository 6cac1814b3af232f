"""How long something took or will take, as a person reads it (the watch table, a training stage's ETA)."""

from __future__ import annotations


def format_duration(seconds: float, to_the_minute_past_an_hour: bool = False) -> str:
    """12 → '12s', 754 → '12m34s', 7384 → '2h03m04s' (or '2h03m', to the minute: as an ETA reads)."""
    total = max(0, int(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m" if to_the_minute_past_an_hour else f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
