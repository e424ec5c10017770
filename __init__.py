"""Qwen3.5 Fast: ComfyUI nodes for Qwen3.5 on run-time-compiled GDN kernels.

ComfyUI imports this folder as a package (under whatever name the folder has). Importing it must
stay cheap and must not fail without CuPy or a GPU: the nodes, and everything heavy, load only when
ComfyUI asks for the extension.
"""
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import Qwen35Extension
    return Qwen35Extension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
