"""The locks: every input of an image and of the launcher environment pinned by URL and sha256.

``imagelock`` reads and checks an image lock (``lockfiles/*.lock.json``: format, hashes, its build root and build
steps, agreement with the stack pins) and says when a lock's requirements changed since it was resolved (the
launcher lock too); ``pypi`` finds a locked hash's file on PyPI and the wheels that fit the image; ``cli`` is
``trainer lock verify`` (offline) and ``trainer lock resolve`` (network). The image phase
(:mod:`trainer.image`) builds from a lock and only reads it.
"""
