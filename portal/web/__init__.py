"""The browser pages, one package per domain; routed by `portal.page_urls`."""
