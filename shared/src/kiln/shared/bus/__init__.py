"""kiln's bus: a small client over nats-py (``client``), what its handlers see
(``delivery``), how a service connects (``connect``), the streams and stores it declares
(``topology``) and who may publish what (``auth``).

The names services use are re-exported here, so ``from kiln.shared.bus import Bus``
is the one import a service needs; the invariants of each part are in its module.
"""

from kiln.shared.bus.client import Bus
from kiln.shared.bus.delivery import Delivery, Handler, Reject, RemoteError, Retry, ServiceError

__all__ = ["Bus", "Delivery", "Handler", "Reject", "RemoteError", "Retry", "ServiceError"]
