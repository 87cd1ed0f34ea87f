"""YAML configs shipped with specframe (this folder is installed as the package `specframe.configs`)."""
