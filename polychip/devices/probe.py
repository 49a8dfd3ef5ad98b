"""Removed in plugin API 1.2: API 1.0's path of the kit, an alias with a DeprecationWarning through 1.1
(docs/plugin-guide.md, "How public modules move"). Importing it says where the module went."""
raise ImportError("polychip.devices.probe was removed in plugin API 1.2 (deprecated since 1.1): "
                  "import polychip.pluginkit.probe")
