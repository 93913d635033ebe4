"""One worker's server, on trio: a connection's life from accept to its end
(:mod:`.lifecycle`, the glue), and the parts it takes its steps with: who a client is
(:mod:`.authenticator`) and what it may touch (:mod:`.access`), which connection holds
each client id (:mod:`.online`), messages to subscribers here and elsewhere
(:mod:`.fanout`, :mod:`.retained_delivery`, :mod:`.delayed_wills`), presence events
(:mod:`.events`), the stores a coordinator keeps (:mod:`.stores`), and what an operator
sees (:mod:`.metrics`, :mod:`.dashboard`). :mod:`.connection` is a client connection
as all of them see it, whichever engine serves it.

May import: :mod:`..mqtt`, :mod:`..presence`, :mod:`..broker`, :mod:`..security`,
:mod:`..coordination` and the settings (:mod:`..config`). The engines that drive
connections (:mod:`..transports`) import it, never the other way.
"""
