"""MQTT itself, sans-IO: the wire format of 3.1, 3.1.1 and 5.0 (:mod:`.packets`,
:mod:`.reader`, :mod:`.bodies`, :mod:`.encoders`, and :mod:`.v5`), topic filters
(:mod:`.filters`) and one connection's protocol state (:mod:`.session`, which returns
:mod:`.effects`), with the records they pass: a message (:mod:`.publication`), why a
connection ended (:mod:`.endings`), what one client may hold (:mod:`.policy`); and the
client's side of a session with another broker, for bridges (:mod:`.client`).

Bytes in, values and effects out: nothing here does I/O, reads a clock or imports
trio. May import: the standard library only. Everything else in the server imports it.
"""
