"""Golden values for the evaluation metrics, each worked out by hand in the comment beside it."""

import pytest

from flexicache.evaluation import longbench
from flexicache.evaluation import metrics as m


def test_normalize_answer():
    assert m.normalize_answer("The Quick, brown fox!  An apple") == "quick brown fox apple"
    assert m.normalize_answer("") == ""


def test_normalize_zh_answer():
    # lowercase, English and Chinese punctuation gone, all whitespace gone
    assert m.normalize_zh_answer("你好，世界！ A B.") == "你好世界ab"


def test_qa_f1():
    # "cat sat on mat" vs "cat on mat": 3 shared, P = 3/4, R = 1 -> F1 = 6/7
    assert m.qa_f1("The cat sat on the mat.", "A cat on a mat") == pytest.approx(6 / 7)
    assert m.qa_f1("Paris", "paris!") == 1.0
    assert m.qa_f1("", "Paris") == 0.0
    assert m.qa_f1("", "") == 0.0
    # counts matter: {x: 2, y: 1} vs {x: 1, y: 2} share one x and one y -> P = R = 2/3
    assert m.qa_f1("x x y", "x y y") == pytest.approx(2 / 3)


def test_qa_f1_zh():
    # jieba: 我/爱/北京/。 -> [我, 爱, 北京] vs [北京]: 1 shared, P = 1/3, R = 1 -> F1 = 1/2
    assert m.qa_f1_zh("我爱北京。", "北京") == pytest.approx(0.5)
    assert m.qa_f1_zh("北京", "北京") == 1.0
    assert m.qa_f1_zh("", "北京") == 0.0
    assert m.qa_f1_zh("。", "。") == 0.0  # only punctuation: nothing left to compare


def test_token_f1():
    assert m.token_f1([], []) == 0.0
    assert m.token_f1(["a", "b"], ["b", "c", "d"]) == pytest.approx(2 * 0.5 * (1 / 3) / (0.5 + 1 / 3))


def test_lcs_and_plain_rouge_l():
    assert m.lcs_length("ABCBDAB", "BDCABA") == 4  # the textbook example
    assert m.lcs_length("", "abc") == 0
    # a,c,d shared in order: P = R = 3/4
    assert m.rouge_l_f1(list("abcd"), list("acde")) == pytest.approx(0.75)
    assert m.rouge_l_f1([], []) == 1.0
    assert m.rouge_l_f1([], ["a"]) == 0.0
    assert m.rouge_words("Hello, World! x-1") == ["hello", "world", "x", "1"]


def test_longbench_rouge_l():
    # sentences split on '.': hyp [the cat sat] [on the mat], ref [the cat was on the mat]
    # LCS words: {the, cat} and {on, the, mat}; union 4; distinct words: 5 in each -> P = R = 4/5
    assert m.longbench_rouge_l("the cat sat. on the mat", "the cat was on the mat") == pytest.approx(0.8, abs=1e-7)
    # distinct-word counting: "a a a" vs "a" is a perfect score (plain ROUGE-L would give 0.5)
    assert m.longbench_rouge_l("a a a", "a") == pytest.approx(1.0, abs=1e-7)
    assert m.longbench_rouge_l("x y", "z") == 0.0
    # no sentence at all -> the package raises, LongBench scores 0
    assert m.longbench_rouge_l("", "the cat") == 0.0
    assert m.longbench_rouge_l("...", "the cat") == 0.0
    assert m.longbench_rouge_l("the cat", "") == 0.0


def test_longbench_rouge_l_zh():
    # jieba: 我/爱/北京 vs 我/爱/上海 -> LCS {我, 爱}; 3 distinct words each -> P = R = 2/3
    assert m.longbench_rouge_l_zh("我爱北京", "我爱上海") == pytest.approx(2 / 3, abs=1e-7)
    assert m.longbench_rouge_l_zh("", "我爱上海") == 0.0


def test_classification():
    classes = ["A", "AB", "B"]
    # matches A, AB, B; A and B are inside the reference "AB" and differ from it -> removed -> 1/1
    assert m.classification("AB", "AB", classes) == 1.0
    assert m.classification("B", "A", ["A", "B"]) == 0.0
    assert m.classification("", "A", ["A", "B"]) == 0.0
    # two classes named, the right one among them -> 1/2
    assert m.classification("A or B", "A", ["A", "B"]) == 0.5
    # the official loop skips the item after a removed one: x is removed, y is never checked -> [y, xyz] -> 1/2
    assert m.classification("xyz", "xyz", ["x", "y", "xyz"]) == 0.5


def test_retrieval_and_count():
    assert m.retrieval("Paragraph 3, not Paragraph 5", "Paragraph 3") == 0.5
    assert m.retrieval("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval("", "Paragraph 3") == 0.0
    assert m.retrieval("I don't know", "Paragraph 3") == 0.0
    assert m.retrieval_zh("答案是段落1和段落12", "段落12") == 0.5
    assert m.retrieval_zh("段落12", "段落12") == 1.0
    assert m.count("There are 7 unique paragraphs out of 17", 7) == 0.5
    assert m.count("7", "7") == 1.0
    assert m.count("", "7") == 0.0


def test_code_sim():
    # first line without ` # // is "x = foo(1)"; indel distance 2 over 20 characters -> 90
    assert m.code_sim("```python\n# comment\nx = foo(1)\n", "x = foo(2)") == pytest.approx(0.9)
    assert m.code_sim("\n\nreturn x\nmore", "return x") == 1.0
    assert m.code_sim("# only a comment", "return x") == 0.0
    assert m.code_sim("", "return x") == 0.0
    assert m.fuzz_ratio("abc", "abd") == 67  # 4/6 = 66.67, rounded like fuzzywuzzy
    assert m.fuzz_ratio("", "") == 100
    assert m.first_code_line("// c\n`x`\n  y = 1") == "  y = 1"


def test_ruler_string_match():
    assert m.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert m.string_match_all("abc", ["ABC"]) == 1.0
    assert m.string_match_all("", ["1"]) == 0.0
    assert m.string_match_part("The numbers are 123 and 456.", ["789", "456"]) == 1.0
    assert m.string_match_part("", ["789"]) == 0.0


def test_first_divergence():
    assert m.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert m.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert m.first_divergence([1, 2], [1, 2, 3]) == 2
    assert m.first_divergence([], []) is None
    assert m.first_divergence([], [5]) == 0


def test_longbench_score_rules():
    # trec: scored on the first line only; the second line would add a second class (-> 1/2)
    assert longbench.score("trec", "\nHuman being\nLocation", ["Human being"], ["Human being", "Location"]) == 1.0
    # other tasks see the whole prediction
    assert longbench.score("passage_count", "3\n4", ["3"], None) == 0.5
    # max over references, LongBench-E names map to their task
    assert longbench.score("hotpotqa_e", "Paris", ["London", "paris"], None) == 1.0
    assert longbench.score("hotpotqa", "Paris", [], None) == 0.0
    assert longbench.score("lcc", "x = 1", ["x = 1"], None) == 1.0


def test_length_buckets():
    assert [longbench.length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 20000)] == [
        "0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"]


# ---------------------------------------------------------------- the evaluate modules
def load(name, config=None):
    import evaluate

    from flexicache.evaluation.scoring import module_path

    return evaluate.load(module_path(name), config, keep_in_memory=True)


def test_evaluate_modules_give_the_golden_values():
    # the cases above, through evaluate.load of the package's own modules (offline)
    trec = load("longbench", "trec").compute(
        predictions=["\nHuman being\nLocation", "Location"], references=[["Human being"], ["Human being"]],
        all_classes=[["Human being", "Location"]] * 2)
    assert trec == {"classification": 50.0, "per_sample": {"classification": [1.0, 0.0]}}
    qa = load("longbench", "hotpotqa_e").compute(predictions=["The cat sat on the mat.", "Paris"],
                                                references=[["A cat on a mat"], ["London", "paris"]])
    assert qa["per_sample"]["qa_f1"] == [pytest.approx(6 / 7), 1.0]
    assert qa["qa_f1"] == pytest.approx(100 * (6 / 7 + 1) / 2)
    rouge = load("longbench", "gov_report").compute(predictions=["the cat sat. on the mat"],
                                                    references=[["the cat was on the mat"]])
    assert rouge["per_sample"]["rouge_l"] == [pytest.approx(0.8, abs=1e-7)]
    ruler = load("ruler", "string_match_all").compute(predictions=["The numbers are 123 and 456."],
                                                      references=[["123", "456", "789"]])
    assert ruler["per_sample"] == {"string_match_all": [pytest.approx(2 / 3)]}
    assert load("ruler", "string_match_part").compute(predictions=["456"], references=[["789", "456"]])[
        "string_match_part"] == 100.0
    # w, y, z shared in order (ROUGE-L) and as a bag (F1): P = R = 3/4; the second reference shares nothing
    leval = load("leval").compute(predictions=["w x y z"], references=[["w y z v", "q"]])
    assert leval["per_sample"] == {"rouge_l": [pytest.approx(0.75)], "f1": [pytest.approx(0.75)]}


def test_evaluate_modules_name_their_configs():
    with pytest.raises(KeyError, match="unknown LongBench dataset 'nope'"):
        load("longbench", "nope")
    with pytest.raises(KeyError, match="string_match_all"):
        load("ruler")
