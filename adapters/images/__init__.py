"""Task environments (docs/SPEC.md §12, §16): where a task's files come from and how they
become a root a session runs over.

    environment.py  `Environment`: what a session runs over; the cache of unpacked ones
    unpack.py       the ways an archive, an engine's image or a rootfs enter the cache
    prepare.py      a task's environment prepared before any session is seeded
    dockerfile.py   the images a Dockerfile builds from (a build's key)
    build.py        one Dockerfile build, contained, and its locks per image
    buildbox.py     where a build's processes run (its cgroup and network namespace)
    builder.py      the engine storage a build writes, and what it reads back
    imagestore.py   the session image store: layers shared, no build can write it
    imageids.py     image ids of an engine storage, asked once per change of it

Nothing is imported here: each module is imported by name.
"""
