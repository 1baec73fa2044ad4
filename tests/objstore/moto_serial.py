"""moto's S3 server handling one request at a time: ``python -m tests.objstore.moto_serial
HOST PORT``.

moto checks ``If-None-Match: *`` and then stores the object as two steps, and its own
server (``python -m moto.server``) runs them in a thread per request, so two racing
conditional creates can both succeed there. S3 makes the check and the write one atomic
step; serving requests one at a time gives the tests that guarantee, which is what the
compare-and-set races exercise. Everything else is moto's own application.
"""

from __future__ import annotations

import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import MotoRequestHandler
from werkzeug.serving import run_simple


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, app, threaded=False, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
