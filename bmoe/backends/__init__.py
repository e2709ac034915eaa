"""Backend packs and the signed update feed (the spec's "Backend packs and updates").

``feed.py`` checks the one signed JSON document a release publishes; ``archive.py`` lists
and unpacks a pack's archive with the system's ``tar``, refusing any entry that would leave
its folder; ``registry.py`` reads what ggml registered and loads the installed packs at
start; ``service.py`` holds the state the routes answer from (``bmoe/server/backends_routes.py``).
"""
