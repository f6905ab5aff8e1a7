"""Screens: chat (the default), first-start progress, model picker, chat list, chat settings, help."""
