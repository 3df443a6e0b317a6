"""The ``convoy`` command (typer): ``main`` holds the app and its commands, ``common`` what every
command shares, ``status`` the ``convoy status`` table, ``chaos`` the ``convoy chaos`` drill's
tables.

May import: ``flows``, ``tasks``, ``training``.  Nothing imports it but the entry point.
"""
