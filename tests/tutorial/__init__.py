"""The documentation as a new user follows it: the quickstart and the README's install block
run against the built wheel in a fresh virtualenv (``make test-quickstart``)."""
