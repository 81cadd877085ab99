"""The REST API's viewsets, one module per domain; routed by `portal.api_urls`."""
