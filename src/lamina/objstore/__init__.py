"""The trace's object storage: one interface (:class:`ObjectStore`) chosen by URL scheme
(:func:`open_store`), ``file://`` and ``s3://`` implementations, the conditional-put probe
and a fault-injecting wrapper for tests and drills. See docs/object-store.md."""

from lamina.objstore.base import ObjectMeta, ObjectStore, open_store
from lamina.objstore.probe import check_conditional_put

__all__ = ["ObjectMeta", "ObjectStore", "check_conditional_put", "open_store"]
