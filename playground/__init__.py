"""Fleet Playground: a Gradio app (``python -m playground``) on the engine.

``playground.render`` holds the views (engine snapshot → HTML/SVG) shared by
the Gradio app and the Jupyter widgets; ``playground.app.build_app`` builds
the Gradio page around an ``engine.LLM``.
"""
