"""Scheduled messages: published now, sent when due (``deliver_after`` / ``deliver_at`` on
``publish``). See docs/scheduled.md.

::

    ob.publish(session, "reminders", {"order": 7}, key=7, deliver_after=timedelta(hours=24))

    scheduled = ScheduledMessages(ob)
    scheduled.list(topic="reminders")     # the soonest due first
    scheduled.cancel(message_id)          # never sent; NotScheduled if it fell due already
"""

from __future__ import annotations

from outbox.scheduled.api import ScheduledMessage, ScheduledMessages

__all__ = ["ScheduledMessage", "ScheduledMessages"]
