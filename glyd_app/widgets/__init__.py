"""Widgets of the chat app: stats bar, message views, the input box."""
