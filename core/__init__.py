"""The bottom layer every other package may use: roles and team-tree access,
the API's shared errors, pagination, fields and permissions, the environment
readers of the settings, and form helpers. It imports no other project package."""
