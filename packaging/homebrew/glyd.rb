# Homebrew formula for Glyd's own tap (brew tap glyd-project/glyd; brew install glyd).
#
# Homebrew has no vLLM and no CUDA, so this formula installs the app only (glyd, glyd-chat: Textual
# and its pure-Python dependencies) into a virtualenv in libexec. The engine (vLLM's CPU or CUDA build,
# torch) is installed by glyd-chat on its first run into a virtualenv under the data dir
# (~/Library/Application Support/glyd/engine/venv on macOS), with a progress bar; `glyd doctor` says
# whether it is there and what would run.
#
# Release checklist: set url/sha256 to the release sdist, then run
#   brew update-python-resources glyd
# which rewrites the resource blocks below from PyPI (versions pinned to what CI tested).
class Glyd < Formula
  include Language::Python::Virtualenv

  desc "Lossless bf16 compression of LLM weights and KV cache, with a terminal chat"
  homepage "https://github.com/glyd-project/glyd"
  url "https://files.pythonhosted.org/packages/source/g/glyd/glyd-0.1.0.tar.gz"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000" # release sdist
  license "Apache-2.0"

  depends_on "python@3.12"

  # The app's runtime only: glyd_app and the light part of glyd_engine import nothing else.
  # The heavy dependencies (numpy, safetensors, huggingface_hub, vllm, torch) live in the engine venv.
  resource "linkify-it-py" do
    url "https://files.pythonhosted.org/packages/source/l/linkify-it-py/linkify_it_py-2.2.0.tar.gz"
    sha256 "907acd2d17ac1fbb9ddb62c8957ccbd6158cac602231a15c3b0cd1e215f03cee"
  end

  resource "markdown-it-py" do
    url "https://files.pythonhosted.org/packages/source/m/markdown-it-py/markdown_it_py-4.3.0.tar.gz"
    sha256 "91a58fa5b72c71a40cf7177250fd767480d7a2bb3ac426ccfb76fb90305fdaaa"
  end

  resource "mdit-py-plugins" do
    url "https://files.pythonhosted.org/packages/source/m/mdit-py-plugins/mdit_py_plugins-0.7.0.tar.gz"
    sha256 "26d2179227aaf4d1dc7acffe7a738cbd15cade6b5a61cff0a2cbf9fed93efede"
  end

  resource "mdurl" do
    url "https://files.pythonhosted.org/packages/source/m/mdurl/mdurl-0.1.2.tar.gz"
    sha256 "bb413d29f5eea38f31dd4754dd7377d4465116fb207585f97bf925588687c1ba"
  end

  resource "platformdirs" do
    url "https://files.pythonhosted.org/packages/source/p/platformdirs/platformdirs-4.14.8.tar.gz"
    sha256 "0000000000000000000000000000000000000000000000000000000000000000" # update-python-resources
  end

  resource "pygments" do
    url "https://files.pythonhosted.org/packages/source/p/pygments/pygments-2.21.0.tar.gz"
    sha256 "610ca751c9bc2492b38eb9a38a7fbc93edbbb2d7182edaf34e66ae493dee5c8c"
  end

  resource "rich" do
    url "https://files.pythonhosted.org/packages/source/r/rich/rich-15.0.0.tar.gz"
    sha256 "edd07a4824c6b40189fb7ac9bc4c52536e9780fbbfbddf6f1e2502c31b068c36"
  end

  resource "textual" do
    url "https://files.pythonhosted.org/packages/source/t/textual/textual-8.2.8.tar.gz"
    sha256 "3f106a9fbc73e39dd266c9712432087de78a6d644084c7c241d6a25c3169115b"
  end

  resource "typing-extensions" do
    url "https://files.pythonhosted.org/packages/source/t/typing-extensions/typing_extensions-4.16.0.tar.gz"
    sha256 "dc983d19a509c94dba722ee6abd33940f7c05a89e243c47e907eb4db6f1a43e5"
  end

  resource "uc-micro-py" do
    url "https://files.pythonhosted.org/packages/source/u/uc-micro-py/uc_micro_py-2.0.0.tar.gz"
    sha256 "c53691e495c8db60e16ffc4861a35469b0ba0821fe409a8a7a0a71864d33a811"
  end

  def install
    virtualenv_install_with_resources
  end

  def caveats
    <<~EOS
      The engine (vLLM and torch, several GB) is not part of this formula: glyd-chat installs it
      into its data directory on first run, showing progress. To see where, and what would run:
        glyd doctor
    EOS
  end

  test do
    assert_match version.to_s, shell_output("#{bin}/glyd --version")
    ENV["GLYD_HOME"] = testpath/"glyd-home"
    output = shell_output("#{bin}/glyd doctor")
    assert_match "would", output
    assert_match testpath/"glyd-home", shell_output("#{bin}/glyd paths")
  end
end
