"""The rules that keep clients in their place, pure: password files (:mod:`.passwords`,
ours and Mosquitto's), Mosquitto's ``acl_file`` (:mod:`.acl`), the throttles on failed
logins (:mod:`.throttle`) and on connects per address (:mod:`.connect_rate`).

They decide; :mod:`..server` applies them to connections. May import: :mod:`..mqtt`.
"""
