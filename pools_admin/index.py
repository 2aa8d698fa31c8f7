"""The admin index the Resource pools card is shown on (the template the default site gets).

Imported by the app's ``ready()`` and by its system checks, and by nothing of Django's
models: safe to import before the apps are ready.
"""

from __future__ import annotations

#: The index template the default admin site gets (it extends ``admin/index.html``).
INDEX_TEMPLATE = "pools_admin/index.html"
