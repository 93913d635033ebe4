"""The broker's state, pure: who subscribed to what (:mod:`.subscriptions` over the
tree of :mod:`.topics`), a message routed to this process's subscribers
(:mod:`.routing`) within their byte bounds (:mod:`.budget`), each subscriber's QoS 1
and 2 messages in flight (:mod:`.outbox`), retained messages (:mod:`.retained`) and
the sessions that outlive their connections (:mod:`.persistent`, told by
:mod:`.reports`).

No I/O, no trio, no clock of its own (times are passed in). May import: :mod:`..mqtt`.
"""
