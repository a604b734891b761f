"""Fan-out: one publisher, many subscribers, the newest version of each key (see docs/DELIVERY.md, Fan-out)."""

from .api import Publisher, PublisherOptions, Subscriber, SubscriberOptions
from .versions import VersionedMessage

__all__ = ["Publisher", "PublisherOptions", "Subscriber", "SubscriberOptions", "VersionedMessage"]
