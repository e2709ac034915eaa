"""What a service needs of bmoe-server: registration with the person's init system
(``bmoe-server service ...``), the log file (``--log-file``) and clean stops on a signal.

- ``args``: a start's command line checked and made into a service's.
- ``units``: the systemd unit, launchd plist and Windows task XML (text in, text out).
- ``managers``: the three init systems' commands (systemctl, launchctl, schtasks).
- ``cli``: ``bmoe-server service install | status | start | stop | uninstall``.
- ``logtee``: the child process that timestamps stderr into the log file.
- ``stopping``: what SIGTERM / SIGINT do to a running server.
"""

NAME = "io.bigmoeonedge.server"
