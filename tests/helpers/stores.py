"""Stores instrumented for the tests: a Store that counts what its readers get."""

from __future__ import annotations


def counting_store(url: str):
    """A Store over ``url`` that counts what its readers get: ``bytes_read``, and ``gets`` per key."""
    import collections

    from dcr_log.store import Store

    class CountingStore(Store):
        def get(self, key, size=None, max_size=None):
            data = super().get(key, size=size, max_size=max_size)
            self.bytes_read += len(data)
            self.gets[key] += 1
            return data

    inner = Store.open(url)
    store = CountingStore(inner._inner, inner.url, inner.local_root)
    store.bytes_read = 0
    store.gets = collections.Counter()
    return store
