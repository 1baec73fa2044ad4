"""moto's S3 server handling one request at a time: ``python -m tests.objstore.moto_serial
HOST PORT``.

moto checks ``If-None-Match: *`` and then stores the object as two steps, and its own
server (``python -m moto.server``) runs them in a thread per request, so two racing
conditional creates can both succeed there. S3 makes the check and the write one atomic
step; serving requests one at a time gives the tests that guarantee, which is what the
compare-and-set races exercise.

Every request goes to moto's S3 application. moto's own dispatcher finds each request's
service by matching it against every service moto has; the tests speak only S3, and the
server took a third less CPU without it (800 puts, gets, lists and deletes: 2.2 to 2.6 s
against 3.4 to 3.7 s in three alternating pairs). Everything else is moto's own
application.
"""

from __future__ import annotations

import sys
from typing import Any

from flask import Flask
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import run_simple


class S3Only(DomainDispatcherApplication):
    """moto's dispatcher with every request sent to its S3 application."""

    def get_application(self, environ: dict[str, Any]) -> Flask:
        with self.lock:
            app = self.app_instances.get("s3")
            if app is None:
                app = self.app_instances["s3"] = self.create_app("s3")
        return app


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    app = S3Only(create_backend_app)
    run_simple(host, port, app, threaded=False, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
