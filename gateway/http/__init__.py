"""The HTTP surface: routes, endpoints, SSE streams and bodies, the server, the gateway state."""
