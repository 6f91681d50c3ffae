"""What every gateway layer shares: configuration, API errors, plain event data."""
