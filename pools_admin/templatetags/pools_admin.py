"""Template tags of the pools admin: the card, relative times."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from pools_admin import views

register = template.Library()


@register.inclusion_tag("pools_admin/card.html", takes_context=True)
def pools_card(context: template.Context) -> dict[str, Any]:
    """The "Resource pools" card (nothing for a user who may not view pools).

    Use it in a custom admin index template: ``{% load pools_admin %}{% pools_card %}``.
    """
    request = context.get("request")
    if request is None:
        return {"card": None}
    return views.card_context(request)


def describe_delta(at: datetime, now: datetime | None = None) -> str:
    """``in 4 min``, ``12 s ago``, ``now``: a short relative time."""
    now = now or timezone.now()
    seconds = (at - now).total_seconds()
    future = seconds > 0
    s = abs(seconds)
    if s < 1:
        return "now"
    if s < 90:
        text = f"{s:.0f} s"
    elif s < 90 * 60:
        text = f"{s / 60:.0f} min"
    elif s < 36 * 3600:
        text = f"{s / 3600:.1f} h".replace(".0 h", " h")
    else:
        text = f"{s / 86400:.0f} d"
    return f"in {text}" if future else f"{text} ago"


@register.simple_tag
def reltime(at: datetime | None, now: datetime | None = None) -> SafeString | str:
    """A ``<time>`` element with a relative text and the absolute time as tooltip."""
    if at is None:
        return "—"
    local = timezone.localtime(at)
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        at.isoformat(),
        local.strftime("%Y-%m-%d %H:%M:%S %Z"),
        describe_delta(at, now),
    )


@register.filter
def clock(at: datetime | None) -> str:
    """``HH:MM:SS`` in the current time zone."""
    return timezone.localtime(at).strftime("%H:%M:%S") if at else "—"


@register.filter
def duration(seconds: float | None) -> str:
    """``1.2 s``, ``3 min 4 s``: a short duration."""
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


@register.filter
def held_for(entry: Any) -> float | None:
    """Seconds from admission to finish (or to now while held) of an entry."""
    if entry.admitted_at is None:
        return None
    end: datetime = entry.finished_at or timezone.now()
    admitted: datetime = entry.admitted_at
    return max((end - admitted).total_seconds(), 0.0)
