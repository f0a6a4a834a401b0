"""Faults the harness raises itself, against any server: the TCP fault proxy, client disconnect storms, killing and
restarting a server process, and the client of kvstorm's /admin/faults."""
