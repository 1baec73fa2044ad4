"""A module that starts a thread when imported: a fork server must refuse to preload it
(tests/test_forkserver.py)."""

import threading
import time

threading.Thread(target=lambda: time.sleep(3600), daemon=True).start()
