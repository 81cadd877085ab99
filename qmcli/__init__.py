"""`qm`, Quartermaster's command-line client.

It talks to the portal only through the REST API, so it imports neither Django
nor Celery nor any of the portal's apps (an import-linter contract keeps it
so): `qm --help` starts as fast as the Python interpreter and `requests` load.
"""
